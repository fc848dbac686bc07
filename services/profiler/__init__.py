"""`prfaas profile`: measure a real engine (prefill latency, KV bytes per token, decode step time and
the largest batch that meets a TPOT target) and write a profile ``prfaas plan`` and ``prfaas simulate``
read."""
