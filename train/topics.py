"""Seed material for Magpie-style prompt synthesis: topics x task types.

A small instruct model asked to "write a user message" (the bare user-turn prefix) drifts to a
few favourite subjects; a system-message hint barely steers a 135M model (measured on
SmolLM2-135M-Instruct). Opening words of the user turn steer it strongly ("Write a Python
function" -> coding requests, "Translate" -> translation), so each seeded prompt starts with an
*opener* of a task type, optionally naming a topic, and the model writes the rest.

``{topic}`` in an opener is filled from :data:`TOPICS`, ``{code_topic}`` from
:data:`CODE_TOPICS`, ``{lang}`` from :data:`PROGRAMMING_LANGUAGES`, ``{human_lang}`` from
:data:`HUMAN_LANGUAGES`.
"""

from __future__ import annotations

TOPICS: dict[str, list[str]] = {
    "science": [
        "photosynthesis", "black holes", "plate tectonics", "the human immune system", "climate change",
        "quantum entanglement", "DNA replication", "the water cycle", "volcanoes", "antibiotic resistance",
        "the periodic table", "renewable energy", "ocean currents", "the theory of evolution", "vaccines",
        "the solar system", "nuclear fusion", "earthquakes", "coral reefs", "the speed of light",
    ],
    "history": [
        "the French Revolution", "the Roman Empire", "the Industrial Revolution", "ancient Egypt",
        "the Cold War", "the printing press", "the Silk Road", "World War II", "the Renaissance",
        "the American civil rights movement", "the fall of the Berlin Wall", "the Ming dynasty",
    ],
    "technology": [
        "machine learning", "cloud computing", "blockchain", "cybersecurity", "smartphones", "electric cars",
        "3D printing", "the internet", "self-driving cars", "computer networks", "open-source software",
        "virtual reality", "data privacy", "solar panels", "large language models",
    ],
    "health": [
        "sleep hygiene", "healthy eating", "running a first marathon", "managing stress", "strength training",
        "intermittent fasting", "hydration", "back pain", "meditation", "seasonal allergies",
    ],
    "everyday life": [
        "personal budgeting", "moving to a new city", "job interviews", "time management", "gardening",
        "cooking pasta", "baking bread", "home repairs", "raising a puppy", "planning a wedding",
        "saving for retirement", "learning a new language", "public speaking", "writing a resume",
        "choosing a laptop", "decluttering a home", "caring for houseplants",
    ],
    "travel and culture": [
        "a trip to Japan", "backpacking in Europe", "Italian cuisine", "classical music", "jazz",
        "impressionist painting", "Shakespeare's plays", "world mythology", "film photography", "chess",
        "the Olympic Games", "soccer tactics", "video game design", "street food in Mexico",
    ],
    "business": [
        "starting a small business", "marketing on social media", "negotiating a salary", "remote work",
        "customer service", "supply chains", "inflation", "the stock market", "product management",
        "writing a business plan", "team leadership", "e-commerce",
    ],
    "society": [
        "urban planning", "public transportation", "online education", "voting systems", "recycling",
        "misinformation", "volunteering", "animal welfare", "the ethics of artificial intelligence",
        "freedom of speech",
    ],
}

CODE_TOPICS: list[str] = [
    "binary search", "sorting a list of dictionaries", "parsing a CSV file", "reading a JSON file",
    "a linked list", "recursion", "regular expressions", "a REST API", "unit tests", "string formatting",
    "dates and time zones", "a stack and a queue", "hash maps", "async programming", "error handling",
    "file input and output", "a command-line tool", "a class hierarchy", "matrix multiplication",
    "dynamic programming", "graph traversal", "database queries", "web scraping", "memoization",
]

PROGRAMMING_LANGUAGES: list[str] = ["Python", "JavaScript", "C++", "Java", "Rust", "Go", "SQL", "Bash", "TypeScript",
                                    "C"]

HUMAN_LANGUAGES: list[str] = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian"]

# task type -> openers (the first words of the user turn; the target writes the rest)
TASK_OPENERS: dict[str, list[str]] = {
    "coding": [
        "Write a {lang} function that", "Write a Python function", "How do I implement {code_topic} in {lang}?",
        "Can you explain this {lang} code", "What is the difference between", "Fix the bug in my {lang} code:",
        "Write a {lang} program that", "How can I optimize",
    ],
    "math": [
        "Solve for x:", "A train travels", "What is the probability that", "Calculate", "Prove that",
        "John has", "If a rectangle has", "What is the derivative of", "How many ways can",
    ],
    "writing": [
        "Write a short story about {topic}", "Write a poem about {topic}", "Write an email to",
        "Write a blog post about {topic}", "Draft a cover letter for", "Write a product description for",
        "Write a persuasive essay on {topic}", "Give me a catchy slogan for",
    ],
    "summarization": [
        "Summarize the following article:", "Summarize this paragraph about {topic}:",
        "Give me a one-sentence summary of", "Summarize the main points of {topic}",
        "TL;DR of the following text:",
    ],
    "translation": [
        "Translate the following sentence into {human_lang}:", "Translate this text from {human_lang} to English:",
        "How do you say", "What does this {human_lang} phrase mean:",
    ],
    "qa": [
        "What is {topic}?", "Who", "When did", "Where is", "Why is {topic} important?", "Is it true that",
        "What are the main causes of", "Which",
    ],
    "explanation": [
        "Explain {topic} to a ten-year-old.", "Explain how", "Can you explain {topic}?", "How does",
        "Why do", "What is the difference between", "Describe the process of", "Explain the concept of",
    ],
    "advice": [
        "I need advice on {topic}.", "How can I get better at", "What are some tips for {topic}?",
        "I'm planning", "What should I consider when", "Can you help me with {topic}?",
    ],
    "brainstorming": [
        "Give me 5 ideas for", "List ten", "Suggest some names for", "What are some creative ways to",
        "Brainstorm", "Make a list of",
    ],
    "classification": [
        "Classify the following", "Is the following review positive or negative:",
        "Which of these is not", "Categorize these items:", "Identify the",
    ],
    "rewriting": [
        "Rewrite this sentence to be more formal:", "Paraphrase the following:", "Correct the grammar:",
        "Make this paragraph more concise:", "Rewrite the following in simple English:",
    ],
    "reasoning": [
        "If all", "A farmer has", "Which is heavier,", "What comes next in the sequence", "Three friends",
        "Is it possible to",
    ],
}


def all_topics() -> list[str]:
    """Every general topic, flattened (deterministic order)."""
    return [t for group in TOPICS.values() for t in group]
