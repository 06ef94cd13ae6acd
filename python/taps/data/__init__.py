"""Evaluation prompt sources: HumanEval, MT-Bench (two turns) and user JSONL files."""
from .loaders import (DATASETS, DataError, PromptItem, chat_prompt_ids, load_dataset, load_humaneval, load_jsonl,
                      load_mtbench, package_file)

__all__ = ["DATASETS", "DataError", "PromptItem", "chat_prompt_ids", "load_dataset", "load_humaneval", "load_jsonl",
           "load_mtbench", "package_file"]
