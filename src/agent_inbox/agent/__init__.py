"""What an agent author's handler sees and returns (layer 2: above `store/`).

`app` (the App and its declared defaults), `result` (what a run returns),
`handler` (the Context a run gets, and calling a handler), `steps` (durable
steps), `permits` (what `ctx.permit` answers). Nothing here writes SQL of its
own: durable steps and policies ask `store/`.
"""
