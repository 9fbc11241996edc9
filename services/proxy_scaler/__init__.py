"""proxy-scaler: sizes the credential-proxy fleet and assigns a proxy to each sandbox.

About one proxy per ``SBX_SANDBOXES_PER_PROXY`` requested or running sandboxes, none
when no sandbox runs; a new sandbox gets the least-loaded proxy; when a proxy dies its
sandboxes move to the others; a proxy being removed is drained first. Every step is an
event (``proxy.*``, ``sandbox.proxy_assigned``). One instance works at a time (a lease);
any other takes over when it stops renewing.
"""
