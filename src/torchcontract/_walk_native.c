/* The walk of ``_fqn._walk``, in C: the same copies of a module tree, in fewer instructions.
 *
 * ``walk(root)`` returns exactly what the Python walk collects for a tree whose root has
 * children: ``(modules, classes, (structure, names, holes), forwards, ((counts, keys, ids),
 * (buffer_counts, buffer_keys, buffer_ids)))``, each as ``_fqn`` documents it (``classes``
 * is the tuple of the modules' classes, read while each module is at hand). A member
 * dict of a subclass of dict (``nn.Sequential``'s ``del`` leaves an ``OrderedDict``) is
 * read as Python reads it, through its own iteration. Where the Python walk takes a path
 * of its own (a module whose instance ``__dict__`` lacks one of the three member dicts, as
 * a traced module's does) or a member is no dict at all, it returns None, and ``_fqn``
 * walks the tree in Python instead. A cyclic or too deep tree raises ``RecursionError`` at the same
 * depth Python's recursion limit allows the Python walk.
 *
 * Public C API only; nothing is cached between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *PARAMETERS, *BUFFERS, *MODULES, *FORWARD, *EMPTY;

typedef struct {
    PyObject *modules, *classes, *forwards, *structure, *names, *holes, *counts, *keys, *ids;
    PyObject *buffer_counts, *buffer_keys, *buffer_ids;
} Copies;

/* What a visit answers: 0 done, -1 a Python error is set, 1 the Python walk must do it. */
enum { DONE = 0, FAILED = -1, IN_PYTHON = 1 };

static int append_size(PyObject *list, Py_ssize_t value) {
    PyObject *number = PyLong_FromSsize_t(value);
    if (number == NULL) return FAILED;
    int result = PyList_Append(list, number);
    Py_DECREF(number);
    return result;
}

/* ``items`` (a list of keys or of values) appended to ``list``. */
static int extend(PyObject *list, PyObject *items) {
    Py_ssize_t end = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, end, end, items);
}

/* The keys and the values of ``mapping`` (a dict, or a subclass of dict), as new lists in
 * the order Python iterates them: ``iter(mapping)`` and ``mapping.values()``. */
static int keys_and_values(PyObject *mapping, PyObject **keys, PyObject **values) {
    if (PyDict_CheckExact(mapping)) {
        *keys = PyDict_Keys(mapping);
        *values = *keys ? PyDict_Values(mapping) : NULL;
    } else {
        *keys = PySequence_List(mapping);
        PyObject *view = *keys ? PyObject_CallMethod(mapping, "values", NULL) : NULL;
        *values = view ? PySequence_List(view) : NULL;
        Py_XDECREF(view);
    }
    if (*values != NULL) return DONE;
    Py_CLEAR(*keys);
    return FAILED;
}

/* Each id of ``values`` appended to ``ids``. */
static int extend_ids(PyObject *ids, PyObject *values) {
    Py_ssize_t count = PyList_GET_SIZE(values);
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *id = PyLong_FromVoidPtr(PyList_GET_ITEM(values, index));
        if (id == NULL) return FAILED;
        int result = PyList_Append(ids, id);
        Py_DECREF(id);
        if (result < 0) return FAILED;
    }
    return DONE;
}

/* Each key of ``members`` into ``keys``, and the id of each value into ``ids``. */
static int copy_members(PyObject *members, PyObject *keys, PyObject *ids) {
    if (PyDict_CheckExact(members)) { /* no Python code runs here: no change mid-loop */
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(members, &position, &key, &value)) {
            if (PyList_Append(keys, key) < 0) return FAILED;
            PyObject *id = PyLong_FromVoidPtr(value);
            if (id == NULL) return FAILED;
            int result = PyList_Append(ids, id);
            Py_DECREF(id);
            if (result < 0) return FAILED;
        }
        return DONE;
    }
    PyObject *own_keys, *own_values;
    if (keys_and_values(members, &own_keys, &own_values) < 0) return FAILED;
    int result = extend(keys, own_keys) < 0 ? FAILED : extend_ids(ids, own_values);
    Py_DECREF(own_keys);
    Py_DECREF(own_values);
    return result;
}

/* Which of ``children`` (a list) are ``None``, as a tuple of booleans, with ``parent``. */
static int add_hole(Copies *copies, PyObject *children, Py_ssize_t parent) {
    Py_ssize_t count = PyList_GET_SIZE(children);
    PyObject *absent = PyTuple_New(count);
    if (absent == NULL) return FAILED;
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *flag = PyList_GET_ITEM(children, index) == Py_None ? Py_True : Py_False;
        Py_INCREF(flag);
        PyTuple_SET_ITEM(absent, index, flag);
    }
    PyObject *hole = Py_BuildValue("(nN)", parent, absent);
    if (hole == NULL) return FAILED;
    int result = PyList_Append(copies->holes, hole);
    Py_DECREF(hole);
    return result;
}

static int visit(Copies *copies, PyObject *children, Py_ssize_t parent);

/* One child: its members copied, its own children visited. */
static int visit_child(Copies *copies, PyObject *child) {
    PyObject *attributes = PyObject_GenericGetDict(child, NULL);
    if (attributes == NULL) {
        PyErr_Clear();
        return IN_PYTHON;
    }
    int result = IN_PYTHON;
    PyObject *parameters, *buffers, *grandchildren, *forward;
    Py_ssize_t position = PyList_GET_SIZE(copies->modules);
    if (!PyDict_CheckExact(attributes)) goto done;
    parameters = PyDict_GetItemWithError(attributes, PARAMETERS);
    buffers = parameters ? PyDict_GetItemWithError(attributes, BUFFERS) : NULL;
    grandchildren = buffers ? PyDict_GetItemWithError(attributes, MODULES) : NULL;
    if (grandchildren == NULL) {
        result = PyErr_Occurred() ? FAILED : IN_PYTHON;
        goto done;
    }
    if (!PyDict_Check(parameters) || !PyDict_Check(buffers) || !PyDict_Check(grandchildren))
        goto done;
    forward = PyDict_GetItemWithError(attributes, FORWARD);
    if (forward != NULL) {
        PyObject *key = PyLong_FromSsize_t(position);
        if (key == NULL || PyDict_SetItem(copies->forwards, key, forward) < 0) {
            Py_XDECREF(key);
            result = FAILED;
            goto done;
        }
        Py_DECREF(key);
    } else if (PyErr_Occurred()) {
        result = FAILED;
        goto done;
    }
    result = FAILED;
    if (PyList_Append(copies->modules, child) < 0) goto done;
    if (PyList_Append(copies->classes, (PyObject *)Py_TYPE(child)) < 0) goto done;
    if (append_size(copies->counts, PyDict_Size(parameters)) < 0) goto done;
    if (copy_members(parameters, copies->keys, copies->ids) < 0) goto done;
    if (PyDict_Size(buffers) > 0) {
        if (append_size(copies->buffer_counts, position) < 0) goto done;
        if (append_size(copies->buffer_counts, PyDict_Size(buffers)) < 0) goto done;
        if (copy_members(buffers, copies->buffer_keys, copies->buffer_ids) < 0) goto done;
    }
    result = DONE;
    if (PyDict_Size(grandchildren) > 0) {
        /* The Python walk recurses here: the same limit, the same RecursionError. */
        if (Py_EnterRecursiveCall(" while walking a module tree")) {
            result = FAILED;
            goto done;
        }
        result = visit(copies, grandchildren, position);
        Py_LeaveRecursiveCall();
    }
done:
    Py_DECREF(attributes);
    return result;
}

/* The child visited, or its ``None`` recorded (``values``: the children, as a list). */
static int visit_value(Copies *copies, PyObject *child, PyObject *values, Py_ssize_t parent) {
    if (child != Py_None) return visit_child(copies, child);
    return add_hole(copies, values, parent);
}

/* ``children`` (a dict of another class) read as Python reads it, into lists first. */
static int visit_lists(Copies *copies, PyObject *children, Py_ssize_t parent) {
    PyObject *names, *values;
    if (keys_and_values(children, &names, &values) < 0) return FAILED;
    int result = extend(copies->names, names) < 0 ? FAILED : DONE;
    Py_ssize_t count = PyList_GET_SIZE(values);
    for (Py_ssize_t index = 0; result == DONE && index < count; index++) {
        result = visit_value(copies, PyList_GET_ITEM(values, index), values, parent);
    }
    Py_DECREF(names);
    Py_DECREF(values);
    return result;
}

/* ``children`` of the module at ``parent``: their names, then each child in order. */
static int visit(Copies *copies, PyObject *children, Py_ssize_t parent) {
    if (append_size(copies->structure, parent) < 0) return FAILED;
    if (append_size(copies->structure, PyDict_Size(children)) < 0) return FAILED;
    if (!PyDict_CheckExact(children)) return visit_lists(copies, children, parent);
    Py_ssize_t position = 0;
    PyObject *name, *child;
    while (PyDict_Next(children, &position, &name, &child)) {
        if (PyList_Append(copies->names, name) < 0) return FAILED;
    }
    position = 0;
    while (PyDict_Next(children, &position, &name, &child)) {
        int result;
        if (child == Py_None) { /* rare: the children as a list, for the hole's flags */
            PyObject *values = PyDict_Values(children);
            if (values == NULL) return FAILED;
            result = add_hole(copies, values, parent);
            Py_DECREF(values);
        } else {
            /* Held while visited: a dict of another class below may run Python code. */
            Py_INCREF(child);
            result = visit_child(copies, child);
            Py_DECREF(child);
        }
        if (result != DONE) return result;
    }
    return DONE;
}

static PyObject *walk(PyObject *self, PyObject *root) {
    (void)self;
    Copies copies = {
        PyList_New(0), PyList_New(0), PyDict_New(), PyList_New(0), PyList_New(0),
        PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0),
        PyList_New(0), PyList_New(0), PyList_New(0),
    };
    PyObject *start = NULL, *answer = NULL, *classes = NULL;
    int result;
    PyObject **all = (PyObject **)&copies;
    size_t count = sizeof(copies) / sizeof(PyObject *);
    for (size_t index = 0; index < count; index++) {
        if (all[index] == NULL) goto done;
    }
    start = PyDict_New(); /* the walk's start: position -1, whose one child is the root */
    if (start == NULL || PyDict_SetItem(start, EMPTY, root) < 0)
        goto done;
    result = visit(&copies, start, -1);
    if (result == FAILED) goto done;
    if (result == IN_PYTHON) {
        answer = Py_None;
        Py_INCREF(answer);
        goto done;
    }
    classes = PyList_AsTuple(copies.classes);
    if (classes == NULL) goto done;
    Py_CLEAR(copies.classes);
    /* N: each reference moves into the answer, made or not. */
    answer = Py_BuildValue(
        "(NN(NNN)N((NNN)(NNN)))", copies.modules, classes, copies.structure, copies.names,
        copies.holes, copies.forwards, copies.counts, copies.keys, copies.ids,
        copies.buffer_counts, copies.buffer_keys, copies.buffer_ids);
    for (size_t index = 0; index < count; index++) all[index] = NULL;
done:
    Py_XDECREF(start);
    for (size_t index = 0; index < count; index++) Py_XDECREF(all[index]);
    return answer;
}

static PyMethodDef METHODS[] = {
    {"walk", walk, METH_O,
     "walk(root, /)\n--\n\nThe copies of _fqn's walk of root's tree, or None where the Python "
     "walk must take it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "torchcontract._walk_native",
    "The walk of _fqn in C: the same copies of a module tree, faster.", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__walk_native(void) {
    PARAMETERS = PyUnicode_InternFromString("_parameters");
    BUFFERS = PyUnicode_InternFromString("_buffers");
    MODULES = PyUnicode_InternFromString("_modules");
    FORWARD = PyUnicode_InternFromString("forward");
    EMPTY = PyUnicode_InternFromString("");
    if (!PARAMETERS || !BUFFERS || !MODULES || !FORWARD || !EMPTY) return NULL;
    return PyModule_Create(&MODULE);
}
