"""The team's commands: `make server` (the MLflow tracking server with logins), `make ui`,
`make share` and `make verify`."""
