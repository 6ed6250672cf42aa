"""specdec inside engines people already run: :mod:`specdec.integrations.vllm` runs
specdec's drafters through vLLM's ``custom_class`` proposer hook (optional extra
``specdec[vllm]``). Imported only when asked for."""
