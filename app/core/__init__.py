"""The app's Qt-free core: storage, settings, engine host, chat and drafting controllers.

Nothing here imports Qt, so every behaviour can be tested without a display; the widgets in
``app/views`` only wrap it.
"""
