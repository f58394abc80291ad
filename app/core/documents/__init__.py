"""The user's own files: text extraction (PDF, Word, OpenDocument, plain text), matters (named
sets of files and folders, indexed with SQLite FTS5 and re-indexed when files change), local
retrieval with cited sources, and Word export. Qt-free; nothing here sends anything anywhere.
"""
