"""Who a pulled image's sandbox runs as: read from the image's own ``/etc/passwd`` by
descriptor, never through a link the image planted (``etc`` or ``passwd`` pointing at a
host path would otherwise be resolved on the host)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.runtime.local import bwrap, images, oci


def image_with(root: Path, user: str) -> images.Image:
    config = oci.ImageConfig(env=[], cmd=None, entrypoint=None, working_dir=None, user=user)
    return images.Image("test", (bwrap.Layer(root, "/"),), config=config)


def test_a_named_user_is_found_in_the_images_passwd(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\napp:x:4242:4242::/srv/app:/bin/sh\n")
    assert images.user_of(image_with(tmp_path, "app")) == (4242, "/srv/app")
    assert images.user_of(image_with(tmp_path, "root"))[0] == bwrap.SANDBOX_UID  # never root by name


@pytest.mark.parametrize("planted", ["etc", "passwd"])
def test_a_passwd_reached_through_a_link_is_not_read(tmp_path, planted):
    host, image = tmp_path / "host", tmp_path / "image"
    host.mkdir()
    image.mkdir()
    (host / "passwd").write_text("app:x:4242:4242::/host/home:/bin/sh\n")
    if planted == "etc":
        (image / "etc").symlink_to(host)
    else:
        (image / "etc").mkdir()
        (image / "etc" / "passwd").symlink_to(host / "passwd")
    assert images.user_of(image_with(image, "app")) == (bwrap.SANDBOX_UID, bwrap.home(False))
