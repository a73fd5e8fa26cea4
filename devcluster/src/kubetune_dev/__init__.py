"""The local control plane for development and e2e tests (`kubetune dev up|down|status|env|logs`)."""
