"""Traffic weights: the versioned weights document, its stores (local files, etcd) and the
hot-reloading router every process embeds."""
