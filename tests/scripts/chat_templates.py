"""Chat templates shaped like real models' (ChatML/Qwen with tools and reasoning, Qwen3 with a thinking
generation prompt, Llama 3, Gemma, SmolLM2), each with ``{% generation %}`` markers around the
assistant's text; ``unmarked(template)`` is the same template without them. Plus the tiny tokenizer
with these templates' special tokens, and conversations (multi-turn, tool calls, reasoning)."""

from __future__ import annotations

import re

import llm_tiny

SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "<bos>",
            "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_TOOL_CALLS = (
    "{% for call in message.tool_calls %}{{ '<tool_call>\\n' + ({'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}{% endfor %}"
)

QWEN = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{% if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{% if message.content %}{{ message.content }}{% endif %}" + _TOOL_CALLS +
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3 without thinking: the generation prompt carries an empty think block that a rendered reply does not,
# so the generation prompt is not a prefix of the conversation.
QWEN3 = QWEN.replace("{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
                     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
                     "{% endif %}")

# Qwen3 thinking, as it renders a multi-turn chat: only the assistant turns after the last user message carry
# their think block (empty without reasoning; the model writes it after the generation prompt); earlier ones lose
# it once a later user turn follows, so a turn rendered on its own is not the text it becomes inside the whole
# conversation.
QWEN3_THINKING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    + QWEN.replace("{% if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + "
                    "'\\n</think>\\n\\n' }}{% endif %}",
                    "{% if loop.index0 > ns.last_user %}{{ '<think>\\n' + (message.reasoning_content or '') + "
                    "'\\n</think>\\n\\n' }}{% endif %}")
)

LLAMA3 = (
    "{{ '<|im_start|>' }}{% for message in messages %}"
    "{% set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{% if message.role == 'assistant' %}{% generation %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}{{ ({'name': call.function.name, "
    "'parameters': call.function.arguments} | tojson) }}{% endfor %}{% else %}{{ message.content | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message.content | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

GEMMA = (
    "{{ '<bos>' }}{% if messages[0].role == 'system' %}{% set first = messages[0].content + '\\n\\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% if message.role == 'assistant' %}{{ '<start_of_turn>model\\n' }}{% generation %}"
    "{{ message.content | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<start_of_turn>user\\n' + (first if loop.first else '') + message.content | trim + "
    "'<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0].role != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEMPLATES = {"qwen": QWEN, "qwen3": QWEN3, "qwen3_thinking": QWEN3_THINKING, "llama3": LLAMA3, "gemma": GEMMA,
             "smollm2": SMOLLM2}


def unmarked(template: str) -> str:
    """The template without its generation markers."""
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def make_tokenizer(template: str):
    """mlx-lm's TokenizerWrapper around the tiny fast tokenizer, with ``template`` and SPECIALS."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=llm_tiny.raw_tokenizer(), bos_token="<|im_start|>",
                                 eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                 chat_template=template, clean_up_tokenization_spaces=False)
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    return TokenizerWrapper(hf, eos_token_ids=[hf.eos_token_id])


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}

CONVERSATIONS = {
    "two_turns": {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris, and the capital of Italy is Rome."}]},
    "three_turns": {"messages": [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hello! How are you today?"},
        {"role": "user", "content": "I am fine, thank you."},
        {"role": "assistant", "content": "All that glitters is not gold."},
        {"role": "user", "content": "To be or not to be?"},
        {"role": "assistant", "content": "That is the question."}]},
    "assistant_first": {"messages": [
        {"role": "assistant", "content": "Hello there! How are you today?"},
        {"role": "user", "content": "I am fine, thank you."},
        {"role": "assistant", "content": "That is the question."}]},
    "tools": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("weather", {"city": "Paris"})]},
        {"role": "tool", "content": "sunny, 24 C"},
        {"role": "assistant", "content": "It is sunny in Paris today."}]},
    "tools_two_rounds": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "What is the weather in Paris and in Rome?"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("weather", {"city": "Paris"}), _call("weather", {"city": "Rome"})]},
        {"role": "tool", "content": "sunny, 24 C"},
        {"role": "tool", "content": "cloudy, 18 C"},
        {"role": "assistant", "content": "It is sunny in Paris and cloudy in Rome."},
        {"role": "user", "content": "And in Berlin?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("weather", {"city": "Berlin"})]},
        {"role": "tool", "content": "rainy, 12 C"},
        {"role": "assistant", "content": "It is rainy in Berlin."}]},
    "reasoning": {"messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four.",
         "reasoning_content": "The sum of two and two is four."},
        {"role": "user", "content": "And plus one?"},
        {"role": "assistant", "content": "<think>\nfour plus one is five\n</think>\n\nFive."}]},
}
