"""An OpenAI-compatible server a team already runs (vLLM, SGLang, llama.cpp's server, another `dyn serve`) as the
engine of a `dyn worker`: the router routes to it as to any worker, the request goes on as the server's own
`/v1/completions` with the prompt's token ids."""

from .engine import HttpEngine

__all__ = ["HttpEngine"]
