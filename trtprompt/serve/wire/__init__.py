"""What passes between the serving processes: the engine socket protocol, its one client,
the request types the edges build, and refusal reports.

Imported by every serving process, so it imports no other serve subpackage and nothing of
Triton, Starlette or click.
"""
