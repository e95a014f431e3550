"""`dyn bench`: load generation, metrics and reports for any OpenAI-compatible streaming endpoint.

Modules: `http` (the lean streaming client), `workload` (prompts), `load` (when to send them), `metrics`
(pure figures), `report` (files and plots), `session` (one invocation, end to end).
"""
