"""SGLang adapter: `engine.SglangEngine` drives `sglang.Engine` in-process."""
