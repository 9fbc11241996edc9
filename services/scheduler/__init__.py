"""scheduler: decides every session transition (get-or-create, stop, delete).

``logic`` holds the pure ``decide``; ``handlers`` is the glue that loads state,
appends events with optimistic concurrency and projects them; ``app`` wires it.
"""
