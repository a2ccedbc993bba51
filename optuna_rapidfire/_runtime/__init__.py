"""One device's runtime: the device, its scheduler (who trains next) and its worker thread."""
