"""The vLLM engine as the workers use it: a small wrapper around vLLM's AsyncLLM."""
