"""The HTTP transport under every protocol: body decoding, admission, the shared request
lifecycle (plan -> engine group -> buffered or SSE answer), errors, metrics and draining. It knows
no protocol; helios.protocols builds on it."""
