"""The PrfaaS vLLM KV connector: streams a request's KV from a producer engine to a consumer engine.

Loaded by vLLM through ``kv_connector_module_path="services.kv_connector.connector"``; vLLM itself is
not patched. ``params.KvTransfer`` is the contract from the router, through the workers' RPC conversion, to
the connector.
"""
