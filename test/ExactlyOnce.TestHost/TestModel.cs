using System.Collections.Concurrent;
using MassTransit;
using Microsoft.EntityFrameworkCore;

namespace ExactlyOnce.TestHost;

/// <summary>A business row written by a consumer: one row per effect, with no unique constraint, so duplicates show.</summary>
public sealed class Effect
{
    public long Id { get; set; }
    public Guid MessageId { get; set; }
    public string Consumer { get; set; } = "";
}

public sealed class TestDbContext(DbContextOptions<TestDbContext> options) : DbContext(options)
{
    public DbSet<Effect> Effects => Set<Effect>();

    protected override void OnModelCreating(ModelBuilder modelBuilder)
    {
        modelBuilder.Entity<Effect>(e =>
        {
            e.ToTable("effects");
            e.HasKey(x => x.Id);
            e.Property(x => x.Id).HasColumnName("id");
            e.Property(x => x.MessageId).HasColumnName("message_id");
            e.Property(x => x.Consumer).HasColumnName("consumer");
        });
        modelBuilder.AddExactlyOnce(); // inbox + outbox
    }
}

public sealed record TestMessage(int Value);

/// <summary>An event published through the outbox in the outbox tests (its own type: its own exchange).</summary>
public sealed record OutboxTestEvent(Guid Key, int Index);

/// <summary>Every delivery a plain (non-inbox) consumer received, by message id: what the broker actually delivered.</summary>
public sealed class DeliveryLog
{
    private readonly ConcurrentDictionary<Guid, int> _byMessageId = new();

    public IReadOnlyDictionary<Guid, int> ByMessageId => _byMessageId;

    public int Total => _byMessageId.Values.Sum();

    public void Record(Guid messageId) => _byMessageId.AddOrUpdate(messageId, 1, (_, n) => n + 1);
}

public sealed class CountingConsumer(DeliveryLog log) : IConsumer<OutboxTestEvent>
{
    public Task Consume(ConsumeContext<OutboxTestEvent> context)
    {
        log.Record(context.MessageId!.Value);
        return Task.CompletedTask;
    }
}

/// <summary>Consumes the outbox's events under the inbox, writing one effect per message.</summary>
public sealed class OutboxEffectConsumer(TestDbContext db, ConsumerProbe probe) : IConsumer<OutboxTestEvent>
{
    public Task Consume(ConsumeContext<OutboxTestEvent> context) => probe.RunAsync(nameof(OutboxEffectConsumer), context, db);
}

/// <summary>A consumer that publishes an event: under the inbox with the outbox on, the event commits with the claim.</summary>
public sealed class RepublishingConsumer(TestDbContext db, ConsumerProbe probe) : IConsumer<TestMessage>
{
    public async Task Consume(ConsumeContext<TestMessage> context)
    {
        await context.Publish(new OutboxTestEvent(context.MessageId!.Value, context.Message.Value));
        await probe.RunAsync(nameof(RepublishingConsumer), context, db);
    }
}

/// <summary>
/// What the tests observe and inject: every entry into a consumer body (counted before anything else happens),
/// and hooks that run before and after the consumer's own SaveChanges.
/// </summary>
public sealed class ConsumerProbe
{
    private readonly ConcurrentDictionary<(Guid, string), int> _entries = new();

    public Func<ConsumeContext, TestDbContext, Task>? BeforeSave { get; set; }
    public Func<ConsumeContext, TestDbContext, Task>? AfterSave { get; set; }
    public TimeSpan HoldAfterEntering { get; set; }

    public int Entries(Guid messageId, string consumer) => _entries.TryGetValue((messageId, consumer), out int n) ? n : 0;

    public int TotalEntries => _entries.Values.Sum();

    public IReadOnlyDictionary<(Guid, string), int> AllEntries => _entries;

    internal async Task RunAsync(string consumer, ConsumeContext context, TestDbContext db)
    {
        _entries.AddOrUpdate((context.MessageId!.Value, consumer), 1, (_, n) => n + 1);
        if (HoldAfterEntering > TimeSpan.Zero)
        {
            await Task.Delay(HoldAfterEntering);
        }

        if (BeforeSave is { } before)
        {
            await before(context, db);
        }

        db.Effects.Add(new Effect { MessageId = context.MessageId!.Value, Consumer = consumer });
        await db.SaveChangesAsync();
        if (AfterSave is { } after)
        {
            await after(context, db);
        }
    }
}

public sealed class EffectConsumer(TestDbContext db, ConsumerProbe probe) : IConsumer<TestMessage>
{
    public Task Consume(ConsumeContext<TestMessage> context) => probe.RunAsync(nameof(EffectConsumer), context, db);
}

public sealed class SecondEffectConsumer(TestDbContext db, ConsumerProbe probe) : IConsumer<TestMessage>
{
    public Task Consume(ConsumeContext<TestMessage> context) => probe.RunAsync(nameof(SecondEffectConsumer), context, db);
}

/// <summary>Version 1 of a consumer that is later renamed (and moved to another queue); its identity is explicit.</summary>
[ConsumerIdentity("stable-effects")]
public sealed class StableEffectConsumerV1(TestDbContext db, ConsumerProbe probe) : IConsumer<TestMessage>
{
    public Task Consume(ConsumeContext<TestMessage> context) => probe.RunAsync("stable-effects", context, db);
}

/// <summary>The same consumer after the rename: same explicit identity.</summary>
[ConsumerIdentity("stable-effects")]
public sealed class StableEffectConsumerV2(TestDbContext db, ConsumerProbe probe) : IConsumer<TestMessage>
{
    public Task Consume(ConsumeContext<TestMessage> context) => probe.RunAsync("stable-effects", context, db);
}
