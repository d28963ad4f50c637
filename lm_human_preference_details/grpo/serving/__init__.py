"""The GRPO inference servers: the contract's HTTP side (`http_contract`), the home-made engine and its server
(`engine`, `server`), and vLLM's (`vllm_server`, in the environment that `vllm_env` makes).

Imports nothing: `http_contract` and `vllm_server` also load in the vLLM environment, whose transformers is older than
the project's and which has none of its other dependencies."""
