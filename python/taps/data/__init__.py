"""Evaluation prompt sources: HumanEval, MT-Bench (two turns) and user JSONL files; turns as token ids."""
from .loaders import (DATASETS, DataError, PromptItem, chat_prompt_ids, encode_prompt, load_dataset, load_humaneval,
                      load_jsonl, load_mtbench, package_file, stop_token_ids)

__all__ = ["DATASETS", "DataError", "PromptItem", "chat_prompt_ids", "encode_prompt", "load_dataset", "load_humaneval",
           "load_jsonl", "load_mtbench", "package_file", "stop_token_ids"]
