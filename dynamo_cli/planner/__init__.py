"""The SLA planner: profile an engine, watch traffic, and size prefill and decode pools to TTFT/ITL targets."""
