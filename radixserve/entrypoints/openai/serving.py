def add_openai_routes(app, tm):
    pass
