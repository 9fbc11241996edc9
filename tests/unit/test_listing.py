"""List indexes and their cursors (pure): a page is the slice of one sorted list, paging is
stable while items come and go, and a cursor only works for the query it was given for."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from sbx_api import errors
from services.gateway import cursors
from shared.contract import states
from shared.domain import listing

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def session(n: int, **fields) -> states.SessionState:
    base = {
        "session_id": f"s{n:05d}",
        "status": "active",
        "created_at": T0 + timedelta(seconds=n),
        "updated_at": T0 + timedelta(seconds=n),
        "last_seq": n + 1,
    }
    return states.SessionState(**{**base, **fields})


def reference(items, status=None, org=None, user=None, image=None):
    """The plain filter-and-sort answer the index must give."""
    return sorted(
        (
            s
            for s in items
            if (s.status == status if status else s.status != "deleted")
            and (org is None or s.org_id == org)
            and (user is None or s.user_id == user)
            and (image is None or s.image == image)
        ),
        key=lambda s: (s.created_at, s.session_id),
    )


def all_pages(index, selector, limit):
    out, after = [], None
    while True:
        page = index.page(selector, after=after, limit=limit)
        out.extend(page.items)
        if page.last is None:
            return out, page.total
        after = page.last


def test_every_filter_combination_pages_like_filtering_everything() -> None:
    rng = random.Random(7)
    items = {}
    index = listing.session_index()
    for n in range(600):
        s = session(
            n,
            status=rng.choice(listing.SESSION_STATUSES),
            org_id=rng.choice([None, "acme", "globex"]),
            user_id=rng.choice([None, "ann", "bob"]),
            image=rng.choice([None, "python:3.12", "node:22"]),
        )
        items[s.session_id] = s
        index.put(s)
    for n in rng.sample(range(600), 200):  # changes move items between lists
        old = items[f"s{n:05d}"]
        new = session(n, status=rng.choice(listing.SESSION_STATUSES), org_id=old.org_id, user_id="bob")
        items[new.session_id] = new
        index.put(new)
    for n in rng.sample(range(600), 50):
        index.remove(f"s{n:05d}")
        items.pop(f"s{n:05d}", None)
    for status in (None, *listing.SESSION_STATUSES):
        for org in (None, "acme", "globex"):
            for user in (None, "ann", "bob"):
                for image in (None, "python:3.12", "node:22"):
                    want = reference(items.values(), status, org, user, image)
                    got, total = all_pages(index, listing.session_selector(status, org, user, image), 7)
                    assert got == want and total == len(want)


def test_a_page_boundary_holds_while_sessions_come_and_go() -> None:
    index = listing.session_index()
    for n in range(100):
        index.put(session(n))
    first = index.page(listing.session_selector(None, None, None, None), after=None, limit=30)
    assert [s.session_id for s in first.items] == [f"s{n:05d}" for n in range(30)]
    index.remove("s00029")  # the boundary item itself goes
    index.remove("s00031")
    index.put(session(5, status="deleted"))  # one already shown goes
    index.put(session(100))  # a new one comes at the end
    seen, after = [], first.last
    while after is not None:
        page = index.page(listing.session_selector(None, None, None, None), after=after, limit=30)
        seen.extend(s.session_id for s in page.items)
        after = page.last
    assert seen == [f"s{n:05d}" for n in range(30, 101) if n != 31]


def test_the_last_page_has_no_continuation_and_an_empty_list_is_empty() -> None:
    index = listing.session_index()
    assert index.page(("live", None, None, None), after=None, limit=10) == listing.Page([], 0, None)
    for n in range(10):
        index.put(session(n))
    page = index.page(("live", None, None, None), after=None, limit=10)
    assert len(page.items) == 10 and page.last is None


CODEC = cursors.Cursors("test-key-0123456789abcdef")
SELECTOR = listing.session_selector(None, "acme", None, None)


def test_a_cursor_round_trips_for_its_own_query() -> None:
    token = CODEC.encode("sessions", SELECTOR, (123, "s1"))
    assert CODEC.decode("sessions", SELECTOR, token) == (123, "s1")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # tag altered
        lambda t: ("e" if t[0] != "e" else "f") + t[1:],  # payload altered
        lambda t: t.replace(".", ""),
        lambda t: t + "." + t,
        lambda t: "",
        lambda t: "!!!.???",
        lambda t: "x" * 600,
        lambda t: cursors.Cursors("another-key-0123456789").encode("sessions", SELECTOR, (123, "s1")),
    ],
)
def test_an_altered_or_foreign_cursor_is_a_clear_400(mangle) -> None:
    token = mangle(CODEC.encode("sessions", SELECTOR, (123, "s1")))
    with pytest.raises(errors.InvalidInput, match="cursor is not one this API returned"):
        CODEC.decode("sessions", SELECTOR, token)


def test_a_cursor_does_not_carry_over_to_other_filters_another_org_or_another_list() -> None:
    token = CODEC.encode("sessions", SELECTOR, (123, "s1"))
    for name, selector in [
        ("sessions", listing.session_selector(None, "globex", None, None)),
        ("sessions", listing.session_selector(None, None, None, None)),
        ("sessions", listing.session_selector("stopped", "acme", None, None)),
        ("snapshots", SELECTOR),
    ]:
        with pytest.raises(errors.InvalidInput):
            CODEC.decode(name, selector, token)
