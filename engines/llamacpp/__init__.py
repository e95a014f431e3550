"""llama.cpp engine plugin; `engines.llamacpp.engine` imports llama_cpp, this package does not."""
