"""The protocol-neutral request layer: the conversation model every protocol decodes into, the
core's tokenizer and chat template, lowering to engine requests, output parsers (reasoning, tool
calls) and the answer model the protocol encoders write from. No HTTP and no protocol JSON here."""
