"""What an agent author's handler sees and returns (layer 2: above `store/`).

`app` (the App and its declared defaults), `result` (what a run returns),
`handler` (the Context a run gets, and calling a handler), `steps` (durable
steps), `permits` (what `ctx.permit` answers), `tool_loop` (an LLM's tool-use
loop as durable steps) and `anthropic_loop` (its adapter for the Anthropic
SDK, which it does not import). Nothing here writes SQL of its
own: durable steps and policies ask `store/`.
"""
