"""The host API's wire contract (frames, bodies, run events, limits, checks).

Defined in the client distribution (:mod:`sbx_client.hostapi`): the agent-host client and
the gateway read and write the same frames; this module is the same one under the
server's name.
"""

from sbx_client.hostapi import *  # noqa: F403
