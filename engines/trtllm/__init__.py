"""TensorRT-LLM adapter: `engine.TrtllmEngine` drives `tensorrt_llm.LLM` in-process."""
