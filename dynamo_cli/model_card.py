"""The model deployment card a worker publishes beside its instance record (runtime/endpoint.py)."""

from __future__ import annotations

import msgspec

from dynamo_cli.engine import EngineInfo, Role
from dynamo_cli.wire import ImageSpec


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """`v1/mdc/{ns}/{comp}/{ep}/{id:x}`: what model an instance serves and how to preprocess for it."""

    display_name: str
    tokenizer_source: str
    """Local path of the GGUF file or HF directory holding the tokenizer and chat template."""
    engine: str
    role: str = Role.BOTH.value
    kv_cache_block_size: int = 16
    context_length: int = 8192
    total_kv_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    eos_token_ids: list[int] = []
    vocab_size: int = 0
    """Token ids the model knows (0..vocab_size-1); 0: unknown."""
    kv_bytes_per_block: int = 0
    """KV cache bytes of one block (`EngineInfo.extra["kv_bytes_per_block"]`); 0: unknown (the router's
    tier costs then assume a default)."""
    features: list[str] = []
    """`Feature` values the engine honours (engine.py); what is not listed is refused at the frontend."""
    loras: list[str] = []
    """LoRA adapters this instance serves (each a model of its own, `display_name` its base), sorted."""
    max_loras: int = 0
    """Adapters resident at once (`--max-loras`); 0: the engine serves no adapters."""
    dp_start: int = 0
    """The first data-parallel rank this instance serves (`EngineInfo.extra["dp_start"]`)."""
    dp_size: int = 1
    """How many ranks, from `dp_start`, each with a scheduler and a KV cache of its own: a routing target each."""
    images: ImageSpec | None = None
    """How the model takes images (a vision-language model); None: text only."""
    nnodes: int = 1
    """Nodes its engine spans (`dyn worker --nnodes`): the leader registers, the followers run headless."""
    bootstrap: str | None = None
    """A prefill engine whose KV moves by rendezvous (SGLang): its bootstrap server's host:port, where
    the decode engine meets it while both run (core/prefill.py)."""

    @property
    def health_check_token(self) -> int:
        """A prompt token every engine of this model accepts: its end-of-sequence token, else id 0."""
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def ranks(self) -> range:
        """The data-parallel ranks this instance serves."""
        return range(self.dp_start, self.dp_start + self.dp_size)

    @property
    def is_ranked(self) -> bool:
        """Whether requests name their rank (`GenerateRequest.dp_rank`): more than one rank, or one not 0."""
        return self.dp_size > 1 or self.dp_start != 0

    @classmethod
    def from_engine(cls, info: EngineInfo, engine: str, role: Role) -> ModelCard:
        return cls(
            display_name=info.model_name,
            tokenizer_source=info.tokenizer_source,
            engine=engine,
            role=role.value,
            kv_cache_block_size=info.block_size,
            context_length=info.context_length,
            total_kv_blocks=info.total_kv_blocks,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            eos_token_ids=list(info.eos_token_ids),
            vocab_size=info.vocab_size,
            kv_bytes_per_block=int(info.extra.get("kv_bytes_per_block", 0)),
            features=sorted(f.value for f in info.features),
            dp_start=int(info.extra.get("dp_start", 0)),
            dp_size=int(info.extra.get("dp_size", 1)),
            bootstrap=info.extra.get("bootstrap") if role is Role.PREFILL else None,
            images=info.images,
        )
