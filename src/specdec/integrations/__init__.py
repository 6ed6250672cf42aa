"""specdec inside engines people already run: :mod:`specdec.integrations.vllm` runs
specdec's drafters through vLLM's ``custom_class`` proposer hook (optional extra
``specdec[vllm]``); :mod:`specdec.integrations.ray` replicates ``specdec serve`` on Ray
Serve (``specdec[ray]``). Each is imported only when asked for."""
