"""OpenAI-compatible HTTP front end for `trtprompt serve`.

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming as
server-sent events) on their own port, translated into requests to Triton's
`ensemble` model over Triton's own gRPC streaming API, so the same front end
works in front of either target. See docs/openai.md.
"""
