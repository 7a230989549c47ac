"""The NATS control plane: every message type and subject, the client plumbing every service
shares, the embedded nats-server, its users and permissions."""
