"""`holoserve serve`'s options come from ServerConfig's fields: the flags, their variables, defaults and
help, the backend choices from the registry, and docs/usage.md's table, so none of them can drift."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from holoserve.serve_cli import add_arguments, config_from_args, options_table
from holoserve.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[3]

# The options as `holoserve serve --help` listed them when they were moved into ServerConfig's metadata:
# (flags, dest, environment variable, default as the help shows it, choices).
OPTIONS = [
    (["--backend"], "backend", "HOLOSERVE_BACKEND", "auto",
     {"auto", "onnxruntime", "openvino", "tensorrt", "torch-cuda", "torch"}),
    (["--host"], "host", "HOLOSERVE_HOST", "127.0.0.1", None),
    (["--port"], "port", "HOLOSERVE_PORT", "8000", None),
    (["--workers"], "workers", "HOLOSERVE_WORKERS", "1", None),
    (["--max-batch-size"], "max_batch_size", "HOLOSERVE_MAX_BATCH_SIZE", "32", None),
    (["--instances"], "instances", "HOLOSERVE_INSTANCES", "auto", None),
    (["--max-queue-delay-ms"], "max_queue_delay_ms", "HOLOSERVE_MAX_QUEUE_DELAY_MS", "0.0", None),
    (["--max-padding-waste"], "max_padding_waste", "HOLOSERVE_MAX_PADDING_WASTE", "auto", None),
    (["--max-batch-tokens"], "max_batch_tokens", "HOLOSERVE_MAX_BATCH_TOKENS", "0", None),
    (["--inline-single", "--no-inline-single"], "inline_single", "HOLOSERVE_INLINE_SINGLE", "True", None),
    (["--max-queue-size"], "max_queue_size", "HOLOSERVE_MAX_QUEUE_SIZE", "256", None),
    (["--max-items"], "max_items", "HOLOSERVE_MAX_ITEMS", "64", None),
    (["--max-text-bytes"], "max_text_bytes", "HOLOSERVE_MAX_TEXT_BYTES", "10000", None),
    (["--max-body-bytes"], "max_body_bytes", "HOLOSERVE_MAX_BODY_BYTES", "1000000", None),
    (["--max-buffered-body-bytes"], "max_buffered_body_bytes", "HOLOSERVE_MAX_BUFFERED_BODY_BYTES", "64000000",
     None),
    (["--max-seq-length"], "max_seq_length", "HOLOSERVE_MAX_SEQ_LENGTH", "0", None),
    (["--threads"], "threads", "HOLOSERVE_THREADS", "0", None),
    (["--openvino-precision"], "openvino_precision", "HOLOSERVE_OPENVINO_PRECISION", "auto",
     {"auto", "f32", "bf16", "f16"}),
    (["--openvino-shapes"], "openvino_shapes", "HOLOSERVE_OPENVINO_SHAPES", "", None),
    (["--openvino-sparse-weights", "--no-openvino-sparse-weights"], "openvino_sparse_weights",
     "HOLOSERVE_OPENVINO_SPARSE_WEIGHTS", "False", None),
    (["--openvino-kernels"], "openvino_kernels", "HOLOSERVE_OPENVINO_KERNELS", "auto",
     {"auto", "on", "off", "reference"}),
    (["--torch-precision"], "torch_precision", "HOLOSERVE_TORCH_PRECISION", "fp32", {"fp32", "fp16"}),
    (["--torch-compile", "--no-torch-compile"], "torch_compile", "HOLOSERVE_TORCH_COMPILE", "False", None),
    (["--torch-cuda-route"], "torch_cuda_route", "HOLOSERVE_TORCH_CUDA_ROUTE", "sparse",
     {"auto", "sparse", "dense-int8"}),
    (["--model-name"], "model_name", "HOLOSERVE_MODEL_NAME", "", None),
    (["--warmup", "--no-warmup"], "warmup", "HOLOSERVE_WARMUP", "True", None),
    (["--verify", "--no-verify"], "verify", "HOLOSERVE_VERIFY", "True", None),
    (["--graceful-timeout"], "graceful_timeout_s", "HOLOSERVE_GRACEFUL_TIMEOUT_S", "30.0", None),
    (["--max-header-bytes"], "max_header_bytes", "HOLOSERVE_MAX_HEADER_BYTES", "16384", None),
    (["--header-timeout"], "header_timeout_s", "HOLOSERVE_HEADER_TIMEOUT_S", "10.0", None),
    (["--body-timeout"], "body_timeout_s", "HOLOSERVE_BODY_TIMEOUT_S", "30.0", None),
    (["--send-timeout"], "send_timeout_s", "HOLOSERVE_SEND_TIMEOUT_S", "30.0", None),
    (["--keep-alive-timeout"], "keep_alive_timeout_s", "HOLOSERVE_KEEP_ALIVE_TIMEOUT_S", "5.0", None),
    (["--max-connections"], "max_connections", "HOLOSERVE_MAX_CONNECTIONS", "1024", None),
    (["--log-level"], "log_level", "HOLOSERVE_LOG_LEVEL", "info", None),
    (["--access-log", "--no-access-log"], "access_log", "HOLOSERVE_ACCESS_LOG", "False", None),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="holoserve serve")
    add_arguments(parser)
    return parser


def test_the_flags_their_variables_and_defaults_are_as_they_were():
    got = []
    for a in _parser()._actions:
        if not a.option_strings or a.dest == "help":
            continue
        env, default = re.search(r"\(env (\S+); default (.*)\)$", a.help, re.S).groups()
        got.append((a.option_strings, a.dest, env, default, set(a.choices) if a.choices else None))
        assert a.default is None  # unset flags leave the environment's value (config_from_args)
    assert got == OPTIONS


def test_every_option_is_described_once_in_its_field():
    helps = {a.dest: a.help for a in _parser()._actions}
    for f in fields(ServerConfig):
        text = f.metadata["help"]
        assert text and text == text.strip(), f.name
        if f.metadata["flag"]:
            assert helps[f.name].startswith(text.replace("%", "%%") + " (env "), f.name
    # argparse formats a help with %: a literal % in a description still shows as one
    assert "at most 10 % padding" in _parser().format_help().replace("\n", " ").replace("  ", " ")


def test_the_backend_choices_are_the_registry(monkeypatch):
    from holoserve.backends import base

    assert set(_parser()._option_string_actions["--backend"].choices) == {"auto", *base.available_backends()}
    monkeypatch.setitem(base._LOADERS, "fake", "tests.nowhere:load")
    parser = _parser()
    assert "fake" in parser._option_string_actions["--backend"].choices
    assert config_from_args(parser.parse_args(["ckpt", "--backend", "fake"])).backend == "fake"


def test_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- serve options:[^\n]*-->\n(.*?)<!-- end of serve options -->", text, re.S)
    assert block, "docs/usage.md has lost the markers around its serve-options table"
    assert block.group(1) == options_table(), (
        "docs/usage.md's serve-options table differs from holoserve.serve_cli.options_table(): paste its output "
        "between the markers")


@pytest.mark.parametrize("name", [f.name for f in fields(ServerConfig) if not f.metadata["flag"]])
def test_settings_without_a_flag_have_none(name):
    assert not any(name == a.dest for a in _parser()._actions if a.option_strings)
