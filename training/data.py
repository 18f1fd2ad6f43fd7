"""Synthetic multi-document question answering, deterministic from a seed.

Every example is a fresh little world: companies (founded by a person, based in
a city) and people (born in a city, with a profession), each described by one
document of natural-sounding filler with its facts placed at random points.
Names come from fixed pools but facts are drawn anew for every example, so a
model can only answer by reading the documents.

- 1-hop: the answer is in one document ("Who founded Harbor Works?").
- 2-hop: it needs two ("In which city was the founder of Harbor Works born?":
  the company's document names the founder, the founder's document the city).

Distractor documents state the same kinds of facts about other entities.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from blend_integrations.chat import rag_prompt
from blend_integrations.config import BlendConfig
from blend_integrations.prompt import TokenizedPrompt

FIRST_NAMES = [
    "Mara",
    "Jonas",
    "Ilse",
    "Tomas",
    "Nadia",
    "Oskar",
    "Lena",
    "Pavel",
    "Ines",
    "Hugo",
    "Greta",
    "Milan",
    "Sofia",
    "Anton",
    "Vera",
    "Emil",
    "Clara",
    "Felix",
    "Rosa",
    "Leon",
    "Alma",
    "Viktor",
    "Nora",
    "Basil",
    "Edith",
    "Rafael",
    "Livia",
    "Gustav",
    "Ada",
    "Marco",
    "Hanna",
    "Dmitri",
    "Irene",
    "Otto",
    "Lucia",
    "Ivan",
    "Petra",
    "Karl",
    "Elsa",
    "Ruben",
]
LAST_NAMES = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Halvorsen",
    "Castell",
    "Brandt",
    "Novak",
    "Ferreira",
    "Adeyemi",
    "Kowalski",
    "Marsh",
    "Quint",
    "Dahl",
    "Rossi",
    "Varga",
    "Ilves",
    "Soto",
    "Barlow",
    "Keane",
    "Holm",
    "Petrov",
    "Nakamura",
    "Osei",
    "Vidal",
    "Strand",
    "Falk",
    "Mendes",
    "Ashby",
    "Kerr",
    "Lund",
    "Orsini",
    "Blom",
    "Crane",
    "Haddad",
    "Ives",
    "Jaeger",
    "Lorca",
    "Mbeki",
    "Nilsen",
    "Pryce",
    "Reyes",
    "Sauer",
    "Tamm",
    "Ueda",
    "Wolde",
    "Yilmaz",
    "Zeller",
    "Arden",
    "Bexley",
    "Corvin",
]
CITIES = [
    "Lenholm",
    "Skarre",
    "Vell",
    "Tessaly",
    "Brimford",
    "Oskvik",
    "Duren",
    "Marlow",
    "Caldera",
    "Fenwick",
    "Gallow",
    "Harwick",
    "Istra",
    "Jorvik",
    "Kestrel",
    "Lydgate",
    "Morrow",
    "Norwick",
    "Ostrava",
    "Penhallow",
    "Quarry",
    "Redwater",
    "Solvik",
    "Tarrant",
    "Umber",
    "Varnes",
    "Westmoor",
    "Yarrow",
    "Zennor",
    "Ashgrove",
    "Bellmere",
    "Cinder",
    "Dunmore",
    "Elsdon",
    "Fallow",
    "Glenrock",
    "Hollins",
    "Irongate",
]
COMPANY_STEMS = [
    "Harbor",
    "Tessel",
    "Northwind",
    "Granite",
    "Bluefin",
    "Copperline",
    "Amber",
    "Silverleaf",
    "Ironbridge",
    "Kestrel",
    "Lantern",
    "Meridian",
    "Oakridge",
    "Pinecrest",
    "Quillon",
    "Riverstone",
    "Saltmarsh",
    "Thornbury",
    "Upland",
    "Vantage",
    "Willow",
    "Yellowpine",
    "Brightwater",
    "Coldspring",
    "Driftwood",
    "Emberly",
    "Foxglove",
    "Goldcrest",
    "Hawthorn",
    "Juniper",
    "Larkspur",
    "Moorland",
    "Nettle",
    "Orchard",
    "Palisade",
    "Ravenhill",
]
COMPANY_KINDS = [
    "Works",
    "Mills",
    "Foundry",
    "Shipping",
    "Press",
    "Textiles",
    "Brewery",
    "Instruments",
    "Glassworks",
    "Traders",
]
PROFESSIONS = [
    "engineer",
    "chemist",
    "sailor",
    "printer",
    "weaver",
    "architect",
    "surveyor",
    "merchant",
    "physician",
    "teacher",
    "carpenter",
    "geologist",
    "brewer",
    "glassmaker",
    "clockmaker",
    "banker",
]

_SUBJECT_FILLER = (
    "{s} is often mentioned in the old records of the region.",
    "Many stories are told about {s} in the local taverns.",
    "Visitors who ask about {s} are usually pointed to the archive.",
    "Little of what was written about {s} in the early years has survived.",
    "A short history of {s} was printed some years ago.",
    "The name of {s} still appears on a few faded signs.",
    "Letters about {s} were kept in a box in the town hall.",
)
_FILLER = (
    "The winters in the region are long and the roads are often closed by snow.",
    "A market is held in the square every week, and farmers bring wheat and cotton.",
    "The river that runs through the valley was once used to carry timber to the coast.",
    "Several bridges were built of stone during that period, and most of them still stand.",
    "The local museum keeps a collection of maps, letters and old tools.",
    "In the spring the fields turn green and the hills are covered with small yellow flowers.",
    "The harbor was busy with ships carrying salt, iron and glass to distant ports.",
    "Schools in the area taught reading, arithmetic and a little history.",
    "The library opened its doors to the public on most afternoons.",
    "A railway line reached the valley late, long after the larger towns had one.",
    "People in the villages kept gardens and traded vegetables at the markets.",
    "The old mill by the water was repaired many times over the years.",
    "Newspapers from the capital arrived a few days late and were read aloud in cafes.",
    "The mountain pass to the north was dangerous in bad weather.",
    "Workers walked to the workshops before sunrise and returned after dark.",
    "A small orchestra played in the park on summer evenings.",
    "The coast is known for its cliffs, its lighthouses and its strong winds.",
    "Records from that time are incomplete, and historians disagree about many details.",
    "Travelers described the inns as simple but clean.",
    "The price of bread rose sharply during the dry years.",
    "Children helped with the harvest at the end of the summer.",
    "The town council met once a month to discuss roads, water and taxes.",
    "A fire destroyed part of the old quarter, which was later rebuilt in brick.",
    "The forests around the valley provided wood for houses and ships.",
    "Copper and silver were mined in the hills for a short time.",
    "Many families moved to the cities in search of work.",
    "The church bells could be heard across the whole valley.",
    "An annual fair brought musicians, merchants and acrobats to the town.",
)


@dataclass
class Company:
    name: str
    founder: str
    city: str
    year: int


@dataclass
class Person:
    name: str
    city: str
    profession: str


@dataclass
class FollowUp:
    """A further question about an example's documents (training asks several per prompt)."""

    question: str
    answer: str
    facts: list[tuple[str, str]]


@dataclass
class Example:
    """One question over its documents (in the order they are shown)."""

    documents: list[str]
    question: str
    answer: str
    hops: int
    kind: str
    evidence: list[int] = field(default_factory=list)  # the documents the answer needs, in hop order
    facts: list[tuple[str, str]] = field(default_factory=list)  # (sentence, what it states) per hop
    follow_ups: list[FollowUp] = field(default_factory=list)  # more questions on the same documents


def _company_facts(c: Company) -> list[str]:
    return [f"{c.name} was founded by {c.founder} in {c.year}.", f"{c.name} is based in {c.city}."]


def _person_facts(p: Person) -> list[str]:
    return [f"{p.name} was born in {p.city}.", f"{p.name} worked as a {p.profession}."]


def _document(rng: random.Random, subject: str, facts: list[str], n_tokens: tuple[int, int]) -> str:
    """Facts spread through filler until the document reaches about the drawn length
    (counted in words and punctuation, which is close to the reader model's tokens)."""
    target = rng.randint(*n_tokens)
    sentences = list(facts)
    while sum(_count(s) for s in sentences) < target:
        pool = _SUBJECT_FILLER if rng.random() < 0.4 else _FILLER
        sentences.insert(rng.randrange(len(sentences) + 1), rng.choice(pool).format(s=subject))
    return f"Notes on {subject}. " + " ".join(sentences)


def _count(sentence: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", sentence))


class World:
    """A fresh set of entities and facts."""

    def __init__(self, rng: random.Random, n_companies: int, n_people: int) -> None:
        people = rng.sample([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES], n_people)
        self.people = [Person(p, rng.choice(CITIES), rng.choice(PROFESSIONS)) for p in people]
        stems = rng.sample(COMPANY_STEMS, n_companies)
        self.companies = [
            Company(f"{s} {rng.choice(COMPANY_KINDS)}", rng.choice(people), rng.choice(CITIES), rng.randint(1801, 1999))
            for s in stems
        ]

    def person(self, name: str) -> Person:
        return next(p for p in self.people if p.name == name)


def _question(
    rng: random.Random, world: World, company: Company, hops: int, founder_doc: bool = True
) -> tuple[str, str, str, list[str], list[tuple[str, str]]]:
    """(question, answer, kind, names of the evidence documents in hop order,
    (sentence, what it states) per hop) about ``company``; questions about its
    founder need ``founder_doc``."""
    founder = world.person(company.founder)
    founded, based = _company_facts(company)
    born, worked = _person_facts(founder)
    one_hop = ["founder", "based", "born"] if founder_doc else ["founder", "based"]
    kind = rng.choice(one_hop) if hops == 1 else rng.choice(["founder_born", "founder_profession"])
    if kind == "founder":
        return f"Who founded {company.name}?", company.founder, kind, [company.name], [(founded, founder.name)]
    if kind == "based":
        return (f"In which city is {company.name} based?", company.city, kind, [company.name], [(based, company.city)])
    if kind == "born":
        return f"In which city was {founder.name} born?", founder.city, kind, [founder.name], [(born, founder.city)]
    if kind == "founder_born":
        return (
            f"In which city was the founder of {company.name} born?",
            founder.city,
            kind,
            [company.name, founder.name],
            [(founded, founder.name), (born, founder.city)],
        )
    return (
        f"What was the profession of the founder of {company.name}?",
        founder.profession,
        kind,
        [company.name, founder.name],
        [(founded, founder.name), (worked, founder.profession)],
    )


# The question templates of ``_question``, each with its subject (the company or
# person the question names), most specific first.
_QUESTION_SUBJECT = tuple(
    re.compile(t)
    for t in (
        r"Who founded (.+)\?",
        r"In which city is (.+) based\?",
        r"In which city was the founder of (.+) born\?",
        r"What was the profession of the founder of (.+)\?",
        r"In which city was (.+) born\?",
    )
)


def question_subject(question: str) -> str:
    """The company or person a generated question is about."""
    for template in _QUESTION_SUBJECT:
        match = template.fullmatch(question)
        if match:
            return match.group(1)
    raise ValueError(f"not a generated question: {question!r}")


def make_example(
    rng: random.Random,
    *,
    hops: int,
    n_docs: tuple[int, int] = (6, 10),
    doc_tokens: tuple[int, int] = (100, 500),
    follow_ups: int = 0,
) -> Example:
    """One question with ``n_docs`` documents (shuffled); its facts and the
    distractors' are drawn from ``rng``. ``follow_ups``: further questions
    about the same documents (for training: more answers per prompt)."""
    n = rng.randint(*n_docs)
    n_companies = max(2, n // 2)
    world = World(rng, n_companies=n_companies, n_people=n - n_companies + 2)
    target = world.companies[0]
    founder = world.person(target.founder)
    # documents: every company; people up to n, always the target's founder
    people = [founder] + [p for p in world.people if p is not founder][: n - n_companies - 1]
    docs = [(c.name, _company_facts(c)) for c in world.companies] + [(p.name, _person_facts(p)) for p in people]
    question, answer, kind, evidence, facts = _question(rng, world, target, hops)
    if len(docs) > n:  # fewer documents than a world has (training's first stage): keep the evidence
        docs = [d for d in docs if d[0] in evidence] + [d for d in docs if d[0] not in evidence][: n - len(evidence)]
    extra = []
    present = {subject for subject, _ in docs}
    companies = [c for c in world.companies if c.name in present]
    for _ in range(follow_ups if companies else 0):
        company = rng.choice(companies)
        has_founder = company.founder in present  # else only the company's own facts can be asked
        q, a, _, _, f = _question(rng, world, company, rng.choice((1, 2)) if has_founder else 1, has_founder)
        extra.append(FollowUp(q, a, f))
    rng.shuffle(docs)
    texts = [_document(rng, subject, sentences, doc_tokens) for subject, sentences in docs]
    subjects = [s for s, _ in docs]
    return Example(texts, question, answer, hops, kind, [subjects.index(name) for name in evidence], facts, extra)


def make_examples(n: int, seed: int, *, two_hop_share: float = 0.5, **kwargs) -> list[Example]:
    """``n`` examples, deterministic from ``seed``; about ``two_hop_share`` of them 2-hop."""
    rng = random.Random(seed)
    return [make_example(rng, hops=2 if rng.random() < two_hop_share else 1, **kwargs) for _ in range(n)]


def corpus_text(n_docs: int, seed: int) -> list[str]:
    """Plain documents for the tokenizer and for language-model training."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n_docs:
        out += make_example(rng, hops=1, n_docs=(4, 6), doc_tokens=(40, 200)).documents
    return out[:n_docs]


def prompt(example: Example, tokenizer) -> TokenizedPrompt:
    """The question as the engines see it, in training and in the benchmark
    (``rag_prompt`` with BlendConfig's default separator)."""
    return rag_prompt(example.documents, example.question, tokenizer, BlendConfig().separator)
