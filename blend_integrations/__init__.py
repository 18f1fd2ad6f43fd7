"""CacheBlend for retrieval-augmented generation: reuse the KV cache of every
retrieved chunk wherever it lands in the prompt, recompute only the tokens
that matter."""

from .chat import BLEND_SEPARATOR, RAG_QUESTION, RAG_SYSTEM_PROMPT, rag_prompt
from .config import BlendConfig
from .engines import Engine, Generation, GenerationStream, Usage, load_engine
from .models import UnsupportedModelError
from .prompt import BlendPrompt, PromptError, TokenizedPrompt
from .store import ChunkStore, CorruptEntryError
from .version import __version__ as __version__

__all__ = [
    "BLEND_SEPARATOR",
    "RAG_QUESTION",
    "RAG_SYSTEM_PROMPT",
    "BlendConfig",
    "BlendPrompt",
    "ChunkStore",
    "CorruptEntryError",
    "Engine",
    "Generation",
    "GenerationStream",
    "PromptError",
    "TokenizedPrompt",
    "UnsupportedModelError",
    "Usage",
    "load_engine",
    "rag_prompt",
]
