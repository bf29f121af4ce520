"""Synthetic facts in prose for Neurocache training: a sentence stated once in a long document,
and later a question about it whose answer repeats the fact's words.

Pass keys teach the cache to copy digits; these teach it to copy words, and to answer a content
question with its content rather than with a pass key. The templates are generic on purpose: none
mirrors a question of `longdoc eval qa`, which stays a held-out check.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from string import Formatter

NAMES = (
    "Anna",
    "Boris",
    "Clara",
    "Daniel",
    "Edith",
    "Felix",
    "Greta",
    "Hugo",
    "Ida",
    "Jonas",
    "Karin",
    "Leo",
    "Marta",
    "Nils",
    "Olga",
    "Pavel",
    "Rosa",
    "Simon",
    "Tilda",
    "Viktor",
    "Wanda",
    "Yusuf",
    "Zora",
    "Emil",
    "Lotte",
    "Oskar",
    "Priya",
    "Ruben",
    "Selma",
    "Tomas",
)
THINGS = (
    "key",
    "letter",
    "map",
    "ring",
    "coin",
    "diary",
    "lantern",
    "knife",
    "watch",
    "violin",
    "compass",
    "photograph",
    "kettle",
    "umbrella",
    "necklace",
    "hammer",
    "candle",
    "telescope",
    "basket",
    "mirror",
)
PLACES = (
    "the floorboards",
    "the old oak tree",
    "the kitchen sink",
    "the chapel steps",
    "the broken stove",
    "the red carpet",
    "the garden wall",
    "the second bed",
    "the stone bridge",
    "the piano",
)
COLOURS = ("green", "yellow", "purple", "orange", "white", "black", "blue", "scarlet", "grey", "brown")
ANIMALS = ("dog", "cat", "horse", "parrot", "goat", "donkey", "rabbit", "pony")
PET_NAMES = (
    "Biscuit",
    "Captain",
    "Pepper",
    "Mustard",
    "Thistle",
    "Comet",
    "Nutmeg",
    "Domino",
    "Pickles",
    "Juniper",
    "Sprout",
    "Marble",
)
CITIES = ("Lisbon", "Krakow", "Bergen", "Naples", "Odessa", "Ghent", "Tallinn", "Seville", "Zurich", "Riga", "Porto", "Bruges")
TRADES = ("baker", "blacksmith", "sailor", "tailor", "miller", "carpenter", "shepherd", "printer", "locksmith", "glassblower")
FOODS = (
    "plum cake",
    "onion soup",
    "roast chestnuts",
    "barley bread",
    "pear jam",
    "smoked herring",
    "apple dumplings",
    "cheese pie",
)


@dataclass(frozen=True)
class Fact:
    statement: str  # stated once in the document
    question: str  # asked at the end
    answer: str  # repeats the statement's words


CHOICES = {
    "thing": THINGS,
    "place": PLACES,
    "colour": COLOURS,
    "animal": ANIMALS,
    "pet": PET_NAMES,
    "city": CITIES,
    "trade": TRADES,
    "food": FOODS,
}

TEMPLATES: tuple[tuple[str, str, str], ...] = (  # statement, question, answer
    ("{name} hid the {thing} under {place}.", "Where did {name} hide the {thing}?", "{name} hid the {thing} under {place}."),
    ("{name} painted the {thing} {colour}.", "What colour did {name} paint the {thing}?", "{name} painted the {thing} {colour}."),
    ("{name} had a {animal} called {pet}.", "What was the name of {name}'s {animal}?", "{name}'s {animal} was called {pet}."),
    ("In the spring {name} moved to {city}.", "Which city did {name} move to?", "{name} moved to {city}."),
    ("{name} worked as a {trade} for many years.", "What was {name}'s trade?", "{name} worked as a {trade}."),
    ("Every Sunday {name} ate {food}.", "What did {name} eat every Sunday?", "Every Sunday {name} ate {food}."),
)


def fill(template: tuple[str, str, str], rng: random.Random, name: str) -> Fact:
    """The template about `name`, each other slot drawn in the order the statement names it."""
    slots = [field for _, field, _, _ in Formatter().parse(template[0]) if field and field != "name"]
    values = {slot: rng.choice(CHOICES[slot]) for slot in slots}
    return Fact(*(part.format(name=name, **values) for part in template))


def facts(rng: random.Random, count: int) -> list[Fact]:
    """`count` facts about different people, the first the one asked about; the others are
    distractors, often of the same template, so only the name tells them apart."""
    names = rng.sample(NAMES, count)
    template = rng.choice(TEMPLATES)
    return [fill(template if i == 0 or rng.random() < 0.5 else rng.choice(TEMPLATES), rng, name) for i, name in enumerate(names)]
