"""The front end: LLMEngine and AsyncLLM turn prompts into engine-core requests and engine-core
outputs into RequestOutputs (tokenize, validate, detokenize, stop strings, n > 1), and talk to
the engine core in this process or in a process of its own through a core client."""
