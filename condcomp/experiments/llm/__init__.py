"""The LLM study: continue-tune SmolLM2 into routed variants and measure quality against KV memory
(``condcomp tune-llm``)."""
