# ruff: noqa
# Verbatim copy of torchtitan/models/__init__.py from torchtitan 0.2.2 (https://github.com/pytorch/torchtitan, the
# PyPI wheel torchtitan-0.2.2-py3-none-any.whl), BSD 3-Clause License, Copyright (c) Meta
# Platforms, Inc. and affiliates. Everything below this header is unchanged (titan_harness.py checks
# it against the wheel's RECORD hash); tests/torchtitan_programs/titan_harness.py ports a copy.
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

_supported_models = frozenset(
    ["deepseek_v3", "flux", "gpt_oss", "llama3", "llama3_ft", "llama4", "qwen3"]
)
