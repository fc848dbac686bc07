"""How KV sits in an engine's paged cache and how it maps between engines: the page layout
(``pages``), what a rank announces about it (``spec``, built by ``from_vllm`` and ``from_config``), the plan
between two clusters' TP sizes and block sizes (``mapping``, ``tp_routes``) and the tensor moves that
carry it out (``apply``, ``reblock``)."""
