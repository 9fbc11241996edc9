"""One error hierarchy for the whole product: every error a user can see, with its stable
``code``, HTTP ``status`` and ``retriable``.

Defined in the client distribution (:mod:`sbx_client.errors`), because the codes are the
public API's and the host API's checks run on both sides; this module is the same one under
the server's name.
"""

from sbx_client.errors import *  # noqa: F403
