"""Offline generation with the Python API (no server): `python examples/offline_inference.py`."""

from kiln import LLM, SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct on the best available device
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
for out in llm.generate(["The capital of France is", "A kiln is"], params):
    print(repr(out.prompt), "->", repr(out.outputs[0].text))

chat = llm.chat([{"role": "user", "content": "Write a haiku about pottery."}], SamplingParams(max_tokens=48))
print(chat[0].outputs[0].text)
