"""The cache observatory: why a request missed the prefix cache, and what the tree holds.

    evictions.py  a bounded record of evicted edges (the tree's eviction listener, O(1) each)
    probe.py      a read-only walk of the tree for one prompt (run where the tree is owned)
    segments.py   which part of a chat prompt (system, tools, message i and field) a char is in
    explain.py    the reason for a miss: new content, evicted, different previous turn,
                  volatile content, reordered, salt; with the text on both sides of it
    report.py     recent misses in a bounded ring, grouped by reason and by segment
    service.py    the server's side: per-request reports on demand, counters, the ring

Nothing here runs unless asked: a request sets `return_cache_report`, or `radixlm lint` runs.
The only always-on cost is the eviction record, one bounded dict write per evicted node.
"""
