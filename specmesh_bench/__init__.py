"""``specmesh bench``: the benchmark every performance claim in this project is measured with.

Runs a workload through the services (a local deployment it starts, or ``--target``), in every
requested mode, interleaved request by request so machine drift hits all modes alike, beside
transformers' own ``generate()`` and prompt-lookup decoding on the same model and prompts.
Writes JSON lines (one per request), a markdown summary and PNG plots.
"""
