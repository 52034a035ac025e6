"""The Responses API (POST /v1/responses): a conversation the tree already holds.

- `protocol` the request's strict schema; what is not supported is declared and refused by name
- `items`    input items and tools <-> Chat Completions' messages and tools; output items
- `store`    stored responses per cache namespace, bounded, for previous_response_id
- `shapes`   the response object, its usage and the events of a stream
- `routes`   POST /v1/responses, GET and DELETE /v1/responses/{id}
"""
