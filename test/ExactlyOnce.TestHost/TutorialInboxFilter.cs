using ExactlyOnce.EntityFrameworkCore;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.TestHost;

/// <summary>
/// The common tutorial inbox, written from its description in PRODUCT.md as the design users would otherwise copy:
/// its own DI scope (so its own DbContext), "does the row exist? no → run the consumer → insert the row". The tests
/// use it to show that their scenarios catch its defects; the benchmarks use it as the "tutorial" mode.
/// </summary>
public sealed class TutorialInboxFilter<TDbContext, TConsumer, TMessage>(IServiceScopeFactory scopes, Func<bool>? failBetweenConsumerAndInsert = null)
    : IFilter<ConsumerConsumeContext<TConsumer, TMessage>>
    where TDbContext : DbContext
    where TConsumer : class
    where TMessage : class
{
    public async Task Send(ConsumerConsumeContext<TConsumer, TMessage> context, IPipe<ConsumerConsumeContext<TConsumer, TMessage>> next)
    {
        using var scope = scopes.CreateScope();
        var db = scope.ServiceProvider.GetRequiredService<TDbContext>();
        Guid id = context.MessageId!.Value;
        string consumer = typeof(TConsumer).FullName!;
        if (await db.Set<InboxMessage>().AnyAsync(m => m.Id == id && m.ConsumerType == consumer))
        {
            return;
        }

        await next.Send(context);
        if (failBetweenConsumerAndInsert?.Invoke() == true)
        {
            throw new InvalidOperationException("injected failure between the consumer's commit and the inbox insert");
        }

        db.Set<InboxMessage>().Add(new InboxMessage { Id = id, ConsumerType = consumer, ReceivedAt = DateTime.UtcNow, ProcessedAt = DateTime.UtcNow });
        try
        {
            await db.SaveChangesAsync();
        }
        catch (DbUpdateException)
        {
            // The primary key stops the second commit — after its side effect already happened.
        }
    }

    public void Probe(ProbeContext context) => context.CreateFilterScope("tutorialInbox");
}
