"""The cache observatory: why a request missed the prefix cache, and what the tree holds.

    probe.py      a read-only walk of the tree for one prompt (run where the tree is owned)
    segments.py   which part of a chat prompt (system, tools, message i and field) a char is in
    explain.py    the reason for a miss: new content, evicted, different previous turn,
                  volatile content, reordered, salt; with the text on both sides of it
    report.py     recent misses in a bounded ring per tenant, grouped by reason and by segment
    salts.py      the prompts' index of the salt check, per tenant
    service.py    the server's side: per-request reports on demand, counters, the rings, the
                  tree picture, each answered for one tenant (a `Viewer`) or the operator
    tree_view.py  the tree as a bounded picture;  page.py  the /cache page
    replay.py     chat bodies through a tree without a model (`radixlm lint`, tests)

A library the server calls (its HTTP routes are server/observatory_routes.py). Nothing here
runs unless asked: a request sets `return_cache_report`, or `radixlm lint` runs. The evicted
edges it reads are the tree's own record (cache/turns.py), always kept for turn inference.
"""
