"""Recipe inference reads the checkpoint's own chat template (issue 40, item 5): the family's
recipe whose stop tokens the template writes, and the tool and reasoning syntax it declares, on
real folders and a real GGUF file's header."""

from __future__ import annotations

import json

import gguf

from ignition.intake import locate, resolve_recipe
from ignition.template_syntax import checkpoint_template
from tests.unit.gguf_writing import finish
from tests.unit.tiny_checkpoints import write_tiny_checkpoint

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
# Llama 3.1's tool instructions in brief: the tools as JSON in the user turn, calls as bare objects.
LLAMA31_TEMPLATE_WITH_TOOLS = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    '{%- if tools and loop.last %}Respond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.{{ tools | tojson }}{%- endif %}"
    "{{ m.content }}<|eot_id|>{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
CHATML_WITH_TOOLS_AND_THINKING = (
    "{%- if tools %}{{ tools | tojson }} Call one inside <tool_call></tool_call>.{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def with_template(folder, template: str):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_template_picks_the_llama_recipe_and_its_syntax(tmp_path):
    llama3 = with_template(write_tiny_checkpoint(tmp_path / "l3", "llama"), LLAMA3_TEMPLATE)
    recipe = resolve_recipe(locate(str(llama3)), None)
    assert recipe.name == "llama3" and not recipe.supports_tools and recipe.reasoning_parser is None
    llama31 = with_template(write_tiny_checkpoint(tmp_path / "l31", "llama"), LLAMA31_TEMPLATE_WITH_TOOLS)
    recipe = resolve_recipe(locate(str(llama31)), None)
    assert (recipe.name, recipe.supports_tools, recipe.tool_parser) == ("llama3", True, "llama3_json")

    chatml = with_template(write_tiny_checkpoint(tmp_path / "chatml", "llama"), CHATML_WITH_TOOLS_AND_THINKING)
    recipe = resolve_recipe(locate(str(chatml)), None)
    assert recipe.name == "smollm2"  # its <|im_end|> is what this template writes
    assert (recipe.supports_tools, recipe.tool_parser, recipe.reasoning_parser) == (True, "hermes", "think")


def test_a_template_without_tools_refuses_them(tmp_path):
    folder = with_template(
        write_tiny_checkpoint(tmp_path / "qwen", "qwen2"),
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}",
    )
    recipe = resolve_recipe(locate(str(folder)), None)
    assert recipe.name == "qwen25_coder" and not recipe.supports_tools and recipe.tool_parser is None
    # A named recipe is taken as written.
    assert resolve_recipe(locate(str(folder)), "qwen25_coder").supports_tools


def test_a_gguf_template_is_read_from_the_header(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_chat_template(LLAMA3_TEMPLATE)
    finish(writer)
    assert checkpoint_template("gguf", path) == LLAMA3_TEMPLATE
    assert checkpoint_template("gguf", tmp_path / "missing.gguf") is None
