"""The data pipeline: tokenizers, text → Megatron ``.bin/.idx``, corpus folders, GPT datasets.

documents   documents streamed from text, JSONL (.gz, .zst), parquet, saved datasets; bad records (the one reader)
tokenizer   sentencepiece / HF tokenizer.json / tiktoken files in megatron-core's tokenizer interface
tokenizer_training   a sentencepiece BPE (byte fallback, exact whitespace) trained on a bounded sample
preprocess  documents → megatron-core IndexedDataset files, each document followed by EOD
shards      the inputs cut into shards over machines, each its .bin/.idx, merged into one
corpus      one folder with train/valid splits, tokenizer and manifest, prepared offline
datasets    GPT train/valid/test datasets through megatron-core's BlendedMegatronDatasetBuilder
state_tracking   the synthetic state-tracking tasks (parity, sum mod 5, S3) as prepared folders
packed_rows  conversations packed into the rows of a microbatch (SFT): attention and fusion boundaries
"""
