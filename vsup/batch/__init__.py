"""The OpenAI Batch API: files, batches and their lines, kept durable in SQLite and run below interactive traffic."""
