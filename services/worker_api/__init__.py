"""The workers' RPC domain types (``types.py``: a request's input, its token deltas, a worker's and a
link's stats) and their protobuf form (``convert.py``), shared by the workers and the router that
calls and polls them. Imports no worker and no vLLM.
"""
