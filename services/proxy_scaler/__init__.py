"""proxy-scaler: sizes the credential-proxy fleet and assigns a proxy to each sandbox.

This version runs the service's lifecycle only: it joins the bus, appends its
instance events, helps keep the instance projection caught up, reports health
and drains on SIGTERM. Its own work arrives with its issue; until then it
reports `capabilities: none yet` in its health details rather than pretending.
"""
