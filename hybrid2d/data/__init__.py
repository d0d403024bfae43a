"""Data for training: corpus -> tokenizer -> flat token cache -> packed samples -> dp-sharded
global batches. `build_data` wires it together for the trainer."""

from hybrid2d.data.build import build_data, build_run_data
from hybrid2d.data.corpus import corpus_documents, default_corpus_files
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.run_data import EvalSet
from hybrid2d.data.tokenizer import eos_id, load_or_train_tokenizer
from hybrid2d.data.tokens import tokenize_corpus

__all__ = [
    "EvalSet",
    "build_run_data",
    "GlobalBatchLoader",
    "PackedDataset",
    "build_data",
    "corpus_documents",
    "default_corpus_files",
    "eos_id",
    "load_or_train_tokenizer",
    "tokenize_corpus",
]
